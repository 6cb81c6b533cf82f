"""Placeholder: RRF alone (replaced by ``bench/fit_fusion.py --write``)."""

MEANS = {
    name: 0.0
    for name in (
        "cosine cosine_below_best vector_rank_reciprocal bm25_of_best keyword_rank_reciprocal"
        " keyword_matched rrf previous_cosine previous_bm25_of_best previous_rrf next_cosine"
        " next_bm25_of_best next_rrf neighbour_rrf_max speaker_named has_caption log_length"
        " is_question previous_is_question"
    ).split()
}
SCALES = dict.fromkeys(MEANS, 1.0)
WEIGHTS = dict.fromkeys(MEANS, 0.0) | {"rrf": 1.0}
INTERCEPT = 0.0
