"""Who is where: datacenter layouts, the process groups they imply, and local multi-process groups."""
