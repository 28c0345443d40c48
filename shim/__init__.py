"""Code that runs inside each rank process to make torch see emulated GPUs."""
