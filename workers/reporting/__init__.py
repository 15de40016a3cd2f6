"""What the ranks report, read as hostile input and shipped to SQL: events, logs, budgets, stacks."""
