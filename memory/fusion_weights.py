"""The learned fusion's fitted formula (memory/learned_fusion.py): standardise, weigh, add.

Written by ``bench/fit_fusion.py --write``; do not edit by hand. Fitted by L2-regularised
logistic regression (C = 1.0) on the LoCoMo slice (../shared/bench/locomo_dev.json:
conversations conv-26, conv-30, conv-41, conv-42, conv-43; 760 questions of categories 1-4, each
in both import layouts), one row per candidate of the product's search (dense and keyword
top 50), labelled by whether the turn is evidence. Held-out recall (fitted on three
conversations, measured on the other two, mean of all ten splits, both layouts):
rrf R@5 0.640 R@10 0.733; learned R@5 0.721 R@10 0.792.
A feature's score is ``(value - MEANS[name]) / SCALES[name] * WEIGHTS[name]``.
"""

MEANS = {
    "cosine": 0.37921685363872354,
    "cosine_below_best": -0.21958798580035,
    "vector_rank_reciprocal": 0.02023594882528415,
    "bm25_of_best": 0.21867557748600785,
    "keyword_rank_reciprocal": 0.02012580617454041,
    "keyword_matched": 0.9940083791449014,
    "rrf": 0.22186849558321697,
    "previous_cosine": 0.28696636268296866,
    "previous_bm25_of_best": 0.15694772325562292,
    "previous_rrf": 0.11563091325654164,
    "next_cosine": 0.27248823992356574,
    "next_bm25_of_best": 0.15996185376998973,
    "next_rrf": 0.10856811404099045,
    "neighbour_rrf_max": 0.18565218555125398,
    "speaker_named": 0.5932312932928823,
    "has_caption": 0.205699643392109,
    "log_length": 4.67244892221746,
    "is_question": 0.2819787555981356,
    "previous_is_question": 0.270976375677669,
}

SCALES = {
    "cosine": 0.13446569950860884,
    "cosine_below_best": 0.12345930555515534,
    "vector_rank_reciprocal": 0.02234631894277617,
    "bm25_of_best": 0.2544116009989281,
    "keyword_rank_reciprocal": 0.022363448463776785,
    "keyword_matched": 0.07717332009591998,
    "rrf": 0.15864849369819697,
    "previous_cosine": 0.15191813442344873,
    "previous_bm25_of_best": 0.23965975991989286,
    "previous_rrf": 0.18924651286023098,
    "next_cosine": 0.14800705231181024,
    "next_bm25_of_best": 0.23620715941816203,
    "next_rrf": 0.17630712742551163,
    "neighbour_rrf_max": 0.21410057239179323,
    "speaker_named": 0.49123103113599864,
    "has_caption": 0.4042119494775831,
    "log_length": 0.590385918739274,
    "is_question": 0.44996303958154443,
    "previous_is_question": 0.44446392373539584,
}

WEIGHTS = {
    "cosine": 0.036518688999044466,
    "cosine_below_best": 0.6655534223266449,
    "vector_rank_reciprocal": -0.017627744919727985,
    "bm25_of_best": 0.7774636303430357,
    "keyword_rank_reciprocal": 0.0659372677940679,
    "keyword_matched": -0.11092519151871501,
    "rrf": 0.05041984227891616,
    "previous_cosine": -0.09041076379080101,
    "previous_bm25_of_best": -0.2347426850753326,
    "previous_rrf": 0.12454122360691271,
    "next_cosine": 0.02040528203794684,
    "next_bm25_of_best": 0.20135052316241228,
    "next_rrf": -0.17464407666885975,
    "neighbour_rrf_max": 0.6924312072569647,
    "speaker_named": 0.7784977983567865,
    "has_caption": 0.14177934424735103,
    "log_length": 0.3914013949451818,
    "is_question": -0.22054815083093715,
    "previous_is_question": 0.268515170378256,
}

INTERCEPT = -6.240692481391007
