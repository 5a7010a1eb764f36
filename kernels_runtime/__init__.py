"""Engine-side parallel runtime of colossal-workbench.

Everything here runs inside a rank: an ipyparallel engine driven from a notebook, or a plain
``torchrun`` process. It never imports IPython or widgets, so the same code trains from a script.
"""

__version__ = "0.1.0"
