"""What a launch needs to know before any kernel exists: the records passed between stages (types, schedule), the GPU
(device), the configs that fit it (planner), the tuned configs on disk (store; entries: their records; schema_v1:
files of the older schema; lengths: which calls each length bucket serves; paths: fa2tune's cache folders) and the
checks on user input (inputs)."""
