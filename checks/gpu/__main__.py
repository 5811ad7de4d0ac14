"""`python -m checks.gpu`: the GPU checks' one command (checks/gpu/harness.py says how to run it on the device)."""

import sys

from checks.gpu.harness import main

sys.exit(main())
