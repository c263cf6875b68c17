"""Models shipped with the package: the demo transformer, benchmark shapes, and
deliberately broken models that the tests and fault drills build."""
