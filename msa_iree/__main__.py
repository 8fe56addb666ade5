"""`python -m msa_iree`: the `msa-iree` command."""
import sys

from .cli import main

sys.exit(main())
