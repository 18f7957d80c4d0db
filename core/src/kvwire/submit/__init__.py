"""Non-blocking sends and arrivals: futures, the in-flight set and pool, notifications, the watcher."""
