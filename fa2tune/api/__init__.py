"""What users call: resolves the config for a call (selection) and hands it to the launch layer — attention()
and attention_varlen() (attention), the custom ops torch.compile sees (ops), get_kernel (attention_kernel)."""
