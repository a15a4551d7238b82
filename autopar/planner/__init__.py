"""Steps 2-4 of the flow: per-node strategies, cost tables, the CP-SAT model, the search
over mesh shapes, and the prediction of a decided plan. Imports no runtime."""
