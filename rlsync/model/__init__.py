"""The model: its architecture from the config (meta-device shapes, layouts) and its build."""
