"""``python -m reference_server --port N [--model PATH] ...``"""

from reference_server.server import serve

serve()
