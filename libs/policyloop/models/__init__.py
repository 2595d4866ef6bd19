"""Models made here: the tokenizer and the small base policy that `policyloop bootstrap` builds."""
