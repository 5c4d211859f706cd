#!/usr/bin/env bash
# Refresh the report's plotly.js: the official "basic" partial bundle (scatter, bar, pie: what the report
# draws) from npm's plotly.js-basic-dist-min, gzipped into loadgen/report/assets/. Keep VERSION equal to
# loadgen/report/builder.py PLOTLY_VERSION.
set -euo pipefail
VERSION="${1:-4.1.1}"
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack -q "plotly.js-basic-dist-min@$VERSION" >/dev/null && tar xzf ./*.tgz)
gzip -9c "$tmp/package/plotly-basic.min.js" > loadgen/report/assets/plotly-basic.min.js.gz
cp "$tmp/package/LICENSE" loadgen/report/assets/plotly-LICENSE
sha256sum "$tmp/package/plotly-basic.min.js"
