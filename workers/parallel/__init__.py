"""Model parallelism: tensor-parallel slices, pipeline stages and the coordinates of every rank."""
