"""Small helpers shared by every layer: atomic files, validation errors, seeding, typed configs."""
