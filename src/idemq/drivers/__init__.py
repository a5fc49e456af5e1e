"""The boundary with the driver libraries: clients from URLs, plan runners, error translation."""
