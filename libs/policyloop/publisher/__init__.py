"""The publisher role: the WeightService over versions on disk (policyloop.weights holds the
store, the library of payloads and the servicer), announcing each durable version on WEIGHTS
(`announcer`) and dead-lettering what the store quarantines (`quarantine`)."""
