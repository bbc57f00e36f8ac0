"""``python -m orchestrator.export``: what the in-training exporter runs, beside the training."""

import sys

from orchestrator.export.command import main

sys.exit(main())
