import sys

from pagedllm.cli import main

sys.exit(main())
