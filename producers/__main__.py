"""`python -m producers`: run a rollout worker."""
import sys

from producers.worker import main

sys.exit(main())
