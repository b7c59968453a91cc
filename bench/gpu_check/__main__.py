import sys

from bench.gpu_check.command import main

sys.exit(main())
