"""`python -m epistemic_kvcache serve ...`"""

import sys

from epistemic_kvcache.cli import main

sys.exit(main())
