# Lets `pytest` and `python tests/x.py` import the packages from a checkout without installing.
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
