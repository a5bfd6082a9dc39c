"""The config room: every knob under verl's key names, read from YAML and the command line, checked."""
