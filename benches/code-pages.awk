# The pages of code (4 KiB) that ran at least `per` instructions in a callgrind dump made
# with --dump-instr=yes: with `per` the requests answered, the code pages a request runs in.
function hex(s,   i, n, c) {
  n = 0; s = tolower(substr(s, 3))
  for (i = 1; i <= length(s); i++) n = n * 16 + index("0123456789abcdef", substr(s, i, 1)) - 1
  return n
}
/^positions:/ { columns = NF - 1; next }
# Addresses are relative to their object: a page is an object's page.
/^ob=/ { object = $1; sub(/\).*/, ")", object); next }
/^calls=/ { call = 1; next }
/^(0x|\+|-|\*)/ {
  # A call's line is the call's inclusive cost, at a position that does not carry on.
  if (call) { call = 0; next }
  if ($1 ~ /^0x/) address = hex($1)
  else if ($1 ~ /^\+/) address += substr($1, 2)
  else if ($1 ~ /^-/) address -= substr($1, 2)
  if (NF > columns) ran[object, int(address / 4096)] += $(columns + 1)
}
END { for (page in ran) if (ran[page] >= per) pages++; print pages + 0 }
