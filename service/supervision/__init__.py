"""The control loop that admits and follows jobs, and the policies it decides with."""
