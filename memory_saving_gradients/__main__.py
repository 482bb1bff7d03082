"""`python -m memory_saving_gradients`: the demo, benchmark suites and plans of `cli`."""

import sys

from memory_saving_gradients.cli.main import main

sys.exit(main())
