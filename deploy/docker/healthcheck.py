"""Container health: exit 0 when /health answers 200 (the engine loop is alive), 1 otherwise."""

import os
import sys
import urllib.request

port = os.environ.get("TURBOSERVE_PORT", "8000")
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError as exc:  # connection refused, timeout, or HTTPError for 503
    print(f"healthcheck: {exc}", file=sys.stderr)
    sys.exit(1)
