"""A recipe on disk: what a folder is (Recipe), how it is rendered, backed up and scanned."""
