import sys

from dashboards.generate import main

sys.exit(main())
