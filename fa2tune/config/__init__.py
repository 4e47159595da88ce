"""What a launch needs to know before any kernel exists: the records passed between stages (types), the GPU
(device), the configs that fit it (planner), the tuned configs on disk (store) and the checks on user input (inputs).
"""
