"""What a run produces and reports: the accuracy and forgetting metrics and the communication
counts (`metrics`), one run's result (`results.RunResult`), where and with what a run ran
(`environment`), and the tables, `results.json`, plots and `edgefcl report` built from results
(`report`). Nothing here is re-exported: import the module by its full path."""
