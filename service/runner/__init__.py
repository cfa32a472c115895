"""What runs inside a job's runner actor, away from the service process: the actor, the rendezvous
coordinator, membership decisions and job metrics."""
