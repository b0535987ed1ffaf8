"""aiayn's tests, mirroring the package."""
