"""``python -m engine_bridge.attach``: see engine_bridge.attach.attach_cli."""

import sys

from engine_bridge.attach.attach_cli import main

sys.exit(main())
