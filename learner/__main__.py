"""`python -m learner`: run the learner service."""
import sys

from learner.service import main

sys.exit(main())
