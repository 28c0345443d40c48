"""What a run tells a person: the report read off the fold, hang diagnoses, every rank's stacks at a
hang, Flight Recorder dumps.
"""
