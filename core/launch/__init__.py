"""Starting ranks as local processes."""
