"""`python -m pagedllm_bench NAME ...`: the same as `pagedllm bench NAME ...`."""

import sys

from pagedllm_bench import main

sys.exit(main(sys.argv[1:]))
