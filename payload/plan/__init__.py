"""What a job costs before renting: the plan, a step's and a stop's costs, chips, the ETA."""
