#!/usr/bin/env bash
# String reversal trained from config alone, through the REST API (curl + jq, no Python):
# upload the tasks, register an environment whose reward is the new `lcs_ratio` checker
# (partial credit by longest common subsequence), QC it, SFT + GRPO the tiny MoE on it, and
# evaluate the base and the trained model (pass@1 / pass@4 with per-sample seeds, and greedy).
#
#   python manage.py up --skip-pipeline     # in another shell; it prints the two variables:
#   export CRUCIBLE_TOKEN=crc_… CRUCIBLE_API_URL=http://127.0.0.1:8000
#   scripts/reverse_demo.sh                 # team "demo", project "arithmetic" (made by `up`)
#
# Tasks: deploy/demo/reverse.jsonl, 600 lowercase strings of 4-8 letters, "<word>>" -> the word
# reversed; 100 carry "split": "eval" (held out).
set -euo pipefail

API="${CRUCIBLE_API_URL:-http://127.0.0.1:8000}/api/v1/teams/${TEAM:-demo}"
PROJECT="${PROJECT:-arithmetic}"
DATA="$(dirname "$0")/../deploy/demo/reverse.jsonl"
: "${CRUCIBLE_TOKEN:?set CRUCIBLE_TOKEN (manage.py up prints one; or manage.py token create)}"
AUTH=(-H "Authorization: Bearer $CRUCIBLE_TOKEN")

call() {  # call METHOD PATH [JSON]: the response body; exits with the API's message on 4xx/5xx
  local method=$1 path=$2 body=${3:-}
  local out status
  out=$(mktemp)
  if [[ -n $body ]]; then
    status=$(curl -sS -o "$out" -w '%{http_code}' -X "$method" "${AUTH[@]}" \
      -H 'Content-Type: application/json' -d "$body" "$API/$path")
  else
    status=$(curl -sS -o "$out" -w '%{http_code}' -X "$method" "${AUTH[@]}" "$API/$path")
  fi
  if [[ $status -ge 400 && $status -ne 409 ]]; then
    echo "$method $path -> $status: $(jq -r '.message // .' "$out")" >&2
    rm -f "$out"
    exit 1
  fi
  cat "$out"
  rm -f "$out"
}

wait_run() {  # wait_run ID: polls until the run ends; fails unless it succeeded
  local status
  while true; do
    status=$(call GET "runs/$1" | jq -r .status)
    case $status in
      succeeded) return 0 ;;
      failed|canceled) echo "run $1 $status: $(call GET "runs/$1" | jq -r .error)" >&2; exit 1 ;;
    esac
    sleep 2
  done
}

echo "1. dataset: upload the tasks file (one call; the version id is its content hash)"
call POST datasets "{\"slug\": \"reverse\", \"project\": \"$PROJECT\"}" >/dev/null
version=$(curl -sS -f "${AUTH[@]}" -F "file=@$DATA" -F message="600 reversal tasks" \
  "$API/datasets/reverse/versions")
digest=$(jq -r .digest <<<"$version")
echo "   reverse v$(jq -r .number <<<"$version"): $(jq -r .record_count <<<"$version") records, $digest"

echo "2. environment: the tasks, rewarded by lcs_ratio (config only)"
call POST environments "{\"slug\": \"reverse\", \"project\": \"$PROJECT\"}" >/dev/null
spec=$(jq -n --arg d "$digest" '{spec: {env: {source: "tasks",
  dataset: {dataset: "reverse", version: 1, digest: $d},
  rubric: {components: [{name: "similar", checker: "lcs_ratio",
                         params: {case_sensitive: true}}]}}}}')
env=$(call POST environments/reverse/versions "$spec")
number=$(jq -r .number <<<"$env")
echo "   reverse@v$number"

echo "3. QC (references must earn 1; the echoed prompt and 'I don't know.' only a bounded share)"
qc=$(call POST "environments/reverse/versions/v$number/qc" '{"name": "QC reverse"}' | jq -r .id)
wait_run "$qc"
call GET "environments/reverse/versions/v$number" | jq -r '.qc_status as $s | .qc_report.summary |
  "   QC \($s): \(.tasks) tasks, \(.quarantined) quarantined, a trivial answer may earn <= \(.trivial_allowed)"'

echo "4. SFT + GRPO on the LCS reward"
model='{"preset": {"num_layers": 2}}'
tokenizer='{"vocab_size": 32}'
train_cfg=$(jq -n --argjson m "$model" --argjson t "$tokenizer" '{model: $m, tokenizer: $t,
  sft: {steps: 150, batch_size: 32},
  rollout: {group_size: 8, max_new_tokens: 10},
  trainer: {steps: 150, prompts_per_step: 16, micro_batch_size: 64, zero_stage: 0, lr: 0.002,
            eval_samples: 2, eval_every: 25},
  checkpoint: {every: 50, keep: 1}}')
train=$(call POST runs "$(jq -n --argjson c "$train_cfg" --arg e "reverse@v$number" --arg p "$PROJECT" \
  '{kind: "train", project: $p, name: "reverse: SFT + GRPO (lcs_ratio)", environments: [$e],
    base_model: "preset", config: $c}')" | jq -r .id)
echo "   run $train"
wait_run "$train"
call GET "runs/$train/metrics?name=eval/reward_mean" | jq -r '.series[0].points |
  "   held-out LCS reward (sampled, T=1): after SFT \(.[0].last | . * 1000 | round / 1000) -> after GRPO \(.[-1].last | . * 1000 | round / 1000)  [" + (map("\(.step): \(.last | . * 1000 | round / 1000)") | join(", ")) + "]"'
echo "   samples at the last step: $(call GET "runs/$train/samples?step=150&limit=3" | jq -c '[.results[] | {prompt, completion, reward, advantage, finish_reason}]')"

echo "5. evaluation of the held-out tasks: base (random init) and trained"
sampled='{"samples_per_task": 4, "k": [1, 4], "chat_format": "raw",
          "sampling": {"max_tokens": 10, "temperature": 1.0, "seed": 0}}'
greedy='{"samples_per_task": 1, "k": [1], "chat_format": "raw",
         "sampling": {"max_tokens": 10, "temperature": 0.0}}'
launch_eval() {  # launch_eval NAME BASE_MODEL CONFIG
  call POST runs "$(jq -n --arg n "$1" --arg b "$2" --argjson c "$3" --arg e "reverse@v$number" \
    --arg p "$PROJECT" '{kind: "eval", project: $p, name: $n, environment: $e, base_model: $b,
                         config: $c}')" | jq -r .id
}
base_sampled=$(launch_eval "reverse eval: base" preset \
  "$(jq -n --argjson s "$sampled" --argjson m "$model" --argjson t "$tokenizer" \
     '$s + {model: $m, tokenizer: $t}')")
final_sampled=$(launch_eval "reverse eval: trained" "run:$train" "$sampled")
final_greedy=$(launch_eval "reverse eval: trained, greedy" "run:$train" "$greedy")
for run in "$base_sampled" "$final_sampled" "$final_greedy"; do
  wait_run "$run"
  call GET "runs/$run/report" | jq -r --arg name "$(call GET "runs/$run" | jq -r .name)" '.summary |
    "   \($name): " + (.pass_at | to_entries | map("pass@\(.key)=\(.value)") | join(" "))
    + " mean LCS reward=\(.mean_reward) (\(.tasks) tasks x \(.samples / .tasks) samples)"'
done
echo "   compare page: ${CRUCIBLE_API_URL:-http://127.0.0.1:8000}/t/${TEAM:-demo}/compare/?run=$base_sampled&run=$final_sampled"
