"""Shared fixtures: the tests import the installed dgps_torch and the float64 reference beside them."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
