# Sourced by scripts/test.sh: removes what the suite writes on the servers it shares, then
# checks that nothing is left. Uses the script's `log`, REDIS_URL and DATABASE_URL.
#
# The suite's namespace: Redis keys under test:* (every test prefix, and the examples'
# IDEMPOTENCY_PREFIX, starts with it); in PostgreSQL the schema idempotency_tests, and the
# databases idempotency_crash_* that crash tests create and drop (left only if a test
# process is killed). Runs against the same servers must not overlap: each removes the
# other's data.

TEST_KEYS='test:*'
TEST_SCHEMA=idempotency_tests
TEST_DATABASES="datname LIKE 'idempotency\_crash\_%'"
# Keys under the store's default prefix are nobody's in particular: only counted before and
# after the run, to report any it added outside its namespace.
DEFAULT_KEYS='idempotency:*'

# The Redis servers holding the suite's keys, as URLs (see find_redis_targets).
redis_targets=()
# Keys under DEFAULT_KEYS on them before the run.
default_keys_before=0

rcli() { redis-cli --no-auth-warning -u "$@"; }

# psql on DATABASE_URL, terse; a stray connection's lock fails a statement instead of
# hanging the script.
pg() {
  PGOPTIONS='-c client_min_messages=warning -c lock_timeout=10s' psql "$DATABASE_URL" -qAtX "$@"
}

drop_test_schema() { pg -c "DROP SCHEMA IF EXISTS $TEST_SCHEMA CASCADE" >/dev/null; }

# $1 (a redis:// URL) pointing at $2 (host:port) instead, with the same credentials.
with_address() {
  local rest=${1#*://} auth=""
  rest=${rest%%/*}
  [[ $rest == *@* ]] && auth="${rest%@*}@"
  echo "${1%%://*}://$auth$2/"
}

# The masters of the Redis Cluster with nodes $1 (comma-separated URLs), one URL a line.
cluster_masters() {
  local seed nodes _id address flags _rest
  for seed in ${1//,/ }; do
    nodes=$(rcli "$seed" cluster nodes 2>/dev/null) || continue
    while read -r _id address flags _rest; do
      [[ $flags == *master* && $flags != *fail* && $flags != *noaddr* ]] || continue
      with_address "$seed" "${address%%@*}"
    done <<<"$nodes"
    return 0
  done
  return 1
}

# The primary the Sentinels $1 (comma-separated URLs) name for master $2, as a URL.
sentinel_primary() {
  local sentinel reply
  for sentinel in ${1//,/ }; do
    mapfile -t reply < <(rcli "$sentinel" sentinel get-master-addr-by-name "$2" 2>/dev/null)
    if [ "${#reply[@]}" -eq 2 ]; then
      echo "redis://${reply[0]}:${reply[1]}/"
      return 0
    fi
  done
  return 1
}

# Fills redis_targets: REDIS_URL, plus the masters of the cluster in $1 and the primary of
# the Sentinels in $2 when the environment gave them (this script stops the ones it starts,
# and tests that start servers of their own remove them).
find_redis_targets() {
  local masters url
  redis_targets=("$REDIS_URL")
  if [ -n "$1" ]; then
    masters=$(cluster_masters "$1") || log "cannot list the masters of REDIS_CLUSTER_URLS"
    for url in $masters; do redis_targets+=("$url"); done
  fi
  if [ -n "$2" ]; then
    if url=$(sentinel_primary "$2" "$REDIS_SENTINEL_MASTER"); then
      redis_targets+=("$url")
    else
      log "cannot find the primary of REDIS_SENTINEL_URLS"
    fi
  fi
}

# Counts the keys matching pattern $2 on the server at $1.
count_keys() { rcli "$1" --scan --pattern "$2" | wc -l; }

# UNLINK commands for the keys read one a line, in the protocol's own framing: no key
# needs quoting, and one key a command suits a cluster node, whose keys span many slots.
unlink_commands() {
  local LC_ALL=C key # so that ${#key} counts bytes
  while IFS= read -r key; do
    printf '*2\r\n$6\r\nUNLINK\r\n$%d\r\n%s\r\n' "${#key}" "$key"
  done
}

# Unlinks the keys matching pattern $2 on the server at $1, pipelined as SCAN pages them
# (never FLUSHDB: the server may hold others' data).
unlink_keys() {
  rcli "$1" --scan --pattern "$2" | unlink_commands | rcli "$1" --pipe >/dev/null
}

# Sums the keys matching pattern $1 over redis_targets; fails if a server does not answer.
count_on_targets() {
  local url n total=0
  for url in "${redis_targets[@]}"; do
    n=$(count_keys "$url" "$1") || return 1
    total=$((total + n))
  done
  echo "$total"
}

# Notes the keys under DEFAULT_KEYS before the run.
count_default_keys() {
  default_keys_before=$(count_on_targets "$DEFAULT_KEYS") || default_keys_before="?"
}

# Removes the suite's data: its Redis keys, its schema, any crash-test databases, and any
# attacker roles left by tests/forged_announcements.rs.
remove_test_data() {
  local url db
  for url in "${redis_targets[@]}"; do
    unlink_keys "$url" "$TEST_KEYS" || log "could not remove the $TEST_KEYS keys on $url"
  done
  drop_test_schema || log "could not drop the schema $TEST_SCHEMA"
  for db in $(pg -c "SELECT datname FROM pg_database WHERE $TEST_DATABASES"); do
    pg -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" || log "could not drop $db"
  done
  # The attackers' roles of tests/forged_announcements.rs (each test drops its own; one cut
  # short may have left it).
  for role in $(pg -c "SELECT rolname FROM pg_roles WHERE rolname LIKE 'idempotency\_test\_attacker\_%'"); do
    pg -c "DROP OWNED BY \"$role\"" -c "DROP ROLE IF EXISTS \"$role\"" || log "could not drop the role $role"
  done
}

# Logs what is left of the suite's data, and the keys under DEFAULT_KEYS before and after
# the run; fails if anything of the suite's is left, or cannot be counted.
report_left_behind() {
  local keys schema databases default_after schema_text databases_text
  keys=$(count_on_targets "$TEST_KEYS") || keys="?"
  schema=$(pg -c "SELECT count(*) FROM pg_namespace WHERE nspname = '$TEST_SCHEMA'") || schema="?"
  databases=$(pg -c "SELECT count(*) FROM pg_database WHERE $TEST_DATABASES") || databases="?"
  case $schema in
    0) schema_text="no schema" ;;
    1) schema_text="the schema $TEST_SCHEMA" ;;
    *) schema_text="schema unknown" ;;
  esac
  case $databases in
    0) databases_text="no databases" ;;
    *) databases_text="$databases databases" ;;
  esac
  log "left behind: $keys Redis keys, $schema_text, $databases_text"

  default_after=$(count_on_targets "$DEFAULT_KEYS") || default_after="?"
  log "outside $TEST_KEYS: $DEFAULT_KEYS keys $default_keys_before before the run, $default_after after"

  [ "$keys" = 0 ] && [ "$schema" = 0 ] && [ "$databases" = 0 ]
}
