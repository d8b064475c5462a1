"""Pipeline parallelism: schedules (pure data, torch-free) and the code that runs them."""
