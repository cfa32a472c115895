"""What crosses the service → workers boundary: the frozen job config, step records and rendezvous messages.

Torch-free and Ray-free: the control plane imports these modules, and pickles them to the workers as they are."""
