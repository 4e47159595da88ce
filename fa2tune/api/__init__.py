"""What users call: resolves the config for a call (selection) and hands it to the launch layer."""
