"""The paper's analyses reproduced on generated modules: bounds, structure, scaling, convergence."""
