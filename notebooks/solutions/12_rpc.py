# Solutions to notebook 12's exercises. Load them into the notebook with `%load solutions/12_rpc.py`.
# Each function imports what it uses inside its body: `check` sends a function's source alone to the workers.
from course_lib import rpc as rpc_lib

theta = sum(p.numel() for p in rpc_lib.make_model().parameters())  # as the notebook's cell above exercise 1


# Exercise 1 (predict): per synchronous step each of the N_t trainers sends a gradient (|theta| values) and gets
# the parameters back (|theta| values): the server moves 2 N_t |theta| values (section 1's 2 (N - 1) |theta|).
predicted_server_values = 2 * 3 * theta  # 3 trainers: 2 N_t |theta|, whatever the number of processes


# Exercise 2 (implement): the read-add-write runs on the owner, on one of its RPC threads, concurrently with
# the other calls: hold the counter's lock across all three, or two calls read the same total.
def add_on_owner(counter_rref, amount):
    counter = counter_rref.local_value()
    with counter.lock:
        total = counter.read() + amount
        counter.write(total)
    return total


# Exercise 3 (diagnose): take *this round's* future under the lock; the last caller installs a fresh future
# for the next round and completes the one every caller of this round holds.
def join_round(rendezvous, value):
    import torch

    with rendezvous.lock:
        rendezvous.values.append(value)
        this_round = rendezvous.round_done
        if len(rendezvous.values) == rendezvous.expected:
            values, rendezvous.values = sorted(rendezvous.values), []
            rendezvous.round_done = torch.futures.Future()
            this_round.set_result(values)
    return this_round
