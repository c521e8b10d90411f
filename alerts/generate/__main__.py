import sys

from alerts.generate import main

sys.exit(main())
