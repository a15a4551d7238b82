"""Checks of the planner that ``autopar.plan`` never imports: the exhaustive optimum over
the same plan space, and the published closed forms recovered symbolically (sympy)."""
