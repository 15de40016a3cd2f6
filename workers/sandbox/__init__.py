"""Where and as whom the ranks run: the code tree, their variables, bubblewrap, scratch, processes."""
