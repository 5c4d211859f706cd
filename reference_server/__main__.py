"""``python -m reference_server --port N [--model PATH] ...``"""

from reference_server.api.cli import serve

serve()
