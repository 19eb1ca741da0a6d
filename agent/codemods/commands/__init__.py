"""One codemod command per module."""
