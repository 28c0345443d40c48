"""What a run asks for and where it goes: the topology and its TOML files, the Setup form's launch
forms and file completion, each launched process's environment, the run directory.
"""
